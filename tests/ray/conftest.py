import pytest

pytest.importorskip("ray")

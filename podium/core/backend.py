"""The backend contract, and how backends are found.

A backend is a class registered under the entry-point group ``podium.backends``::

    [project.entry-points."podium.backends"]
    mybackend = "my_package.podium_backend:MyBackend"

It subclasses :class:`Backend` (how to start a group on a pool, check
resources, shut down) and returns :class:`BackendGroup` objects (how to call
ranks of one running group). :class:`podium.WorkerGroup` does everything else --
dispatch, collect, padding, futures, colocated views -- the same way for every
backend, and every rank runs a :class:`podium.core.host.WorkerHost`.
Nothing in podium changes to add a backend.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import json
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from podium.errors import UnknownBackendError

if TYPE_CHECKING:
    from podium.core.futures import RankFuture
    from podium.core.resource import ResourcePool
    from podium.core.worker import ClassWithInitArgs

__all__ = [
    "BACKEND_NAME_ENV",
    "PREFIX_ENV",
    "RESERVED_ENV",
    "Backend",
    "BackendGroup",
    "BackendOption",
    "Capabilities",
    "GroupSpec",
    "RankCall",
    "available_backends",
    "joining_rows",
    "load_backend",
    "resolve_backend",
    "rows_joined",
]

ENTRY_POINT_GROUP = "podium.backends"
DEFAULT_BACKEND = "ray"
# The launcher's settings, so a trainer moves between launchers unchanged:
# $PODIUM_BACKEND names the backend, $PODIUM_BACKEND_OPTIONS (a JSON object) its options.
BACKEND_ENV = "PODIUM_BACKEND"
OPTIONS_ENV = "PODIUM_BACKEND_OPTIONS"
# Extras that install the backends podium itself ships.
KNOWN_EXTRAS = {"ray": "podium[ray]", "torchrun": "podium[torchrun]"}
# Per-rank variables a backend sets; worker_env may not override them.
RESERVED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Per-group variables WorkerGroup adds to ``worker_env`` on backends with
# ``Capabilities.worker_env`` (the names verl's utilities read); a user's own value wins.
PREFIX_ENV = "WG_PREFIX"  # the group's name_prefix
BACKEND_NAME_ENV = "WG_BACKEND"  # the backend's name


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a backend can do. The conformance suite skips what is False, saying why."""

    process_group: bool = False
    """Ranks are processes whose env makes ``init_process_group()`` work."""
    multi_node: bool = False
    """Pools may span several hosts."""
    gpu: bool = False
    """``use_gpu=True`` pools give each rank its device."""
    fractional_colocation: bool = False
    """Several groups share one pool's slots (``max_colocate_count > 1``)."""
    named_workers: bool = False
    """``WorkerGroup.attach(name_prefix)`` reaches workers started elsewhere."""
    worker_to_worker_futures: bool = False
    """A ``DataProtoFuture`` passed into a call moves between workers, not through the controller."""
    call_timeout: bool = False
    """Deadlines (``register(timeout=)``, ``call_timeout=``) interrupt a wait on a running call."""
    cancels_timed_out_calls: bool = False
    """A call past its deadline is stopped on its ranks: the next call does not wait behind it."""
    detects_dead_workers: bool = False
    """A worker that dies is a ``WorkerDiedError`` at the controller."""
    worker_env: bool = False
    """``worker_env`` sets variables in each rank's own environment."""
    concurrent_async_calls: bool = False
    """A rank starts its next calls while an ``async def`` call awaits (up to the worker's
    ``max_async_calls`` at once); without it a rank's calls run one at a time, async or not."""
    batch_refs: bool = False
    """``output="ref"`` keeps outputs in the ranks and a ``BatchRef`` argument is read worker to worker;
    without it the controller holds the rows (same results, data through the controller)."""

    def as_dict(self) -> dict[str, bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class BackendOption:
    """One accepted key of ``backend_options``: its type, default and help text."""

    name: str
    type: type | tuple[type, ...]
    default: Any
    help: str


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """What :class:`podium.WorkerGroup` asks a backend to start."""

    pool: ResourcePool
    cls_with_init: ClassWithInitArgs[Any]
    name_prefix: str
    worker_env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RankCall:
    """One rank's share of a call.

    Objects that several ranks receive by identity (``args[i] is other.args[i]``,
    as nd-mesh dispatch produces for TP/PP peers) are meant to be serialized
    or stored once and shared.
    """

    rank: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


_rows_joined: contextvars.ContextVar[bool] = contextvars.ContextVar("podium_rows_joined", default=False)


def rows_joined() -> bool:
    """Whether the results being waited for now are only read by a row-wise join.

    True while a :class:`~podium.WorkerGroup` waits for the outputs of a
    blocking DP call whose collect concatenates two or more ``DataProto`` s:
    the collect copies every row of their batches into new tensors, and the
    outputs themselves never reach the user. A backend whose results arrive in
    memory it would otherwise copy to make it private and writable (the Ray
    object store) may then hand batch tensors over that memory as they are.
    Anything else a result holds -- ``meta_info``, ``non_tensor_batch``, a
    value that is not a ``DataProto`` -- must still be made private.
    """
    return _rows_joined.get()


@contextlib.contextmanager
def joining_rows() -> Iterator[None]:
    """The context :func:`rows_joined` reports (entered by the caller that joins the rows)."""
    token = _rows_joined.set(True)
    try:
        yield
    finally:
        _rows_joined.reset(token)


class BackendGroup(ABC):
    """The running ranks of one group, as a backend sees them.

    Behaviours and assumptions:

    1. ``submit`` never blocks on the call itself; it returns one
       :class:`podium.core.futures.RankFuture` per ``RankCall``, in order.
    2. Each rank runs its calls in submission order, one at a time.
    3. A rank that died makes its futures (and every later submit) raise
       :class:`podium.errors.WorkerDiedError` promptly -- never a hang.
    4. ``shutdown`` is idempotent and leaves no process, actor or port behind.
    """

    world_size: int
    worker_names: list[str]

    @abstractmethod
    def submit(self, target: str, calls: Sequence[RankCall], *, timeout: float | None = None) -> list[RankFuture]:
        """Start ``target`` (``"method"`` or ``"role:method"``) on the given ranks."""

    def handles(self) -> Any:
        """This group's native objects, for code that needs the backend itself (an escape hatch).

        Each backend returns a typed record it documents (Ray: actor handles,
        placement groups and bundle indices; torchrun: process ids and hosts;
        inline: the worker objects), reached as ``WorkerGroup.backend_handles``.
        Optional: the default raises ``NotImplementedError`` naming the backend.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__} exposes no native handles (BackendGroup.handles() is optional)"
        )

    def shutdown(self) -> None:
        if getattr(self, "_podium_closed", False):
            return
        self._podium_closed = True
        self._shutdown()

    @abstractmethod
    def _shutdown(self) -> None: ...


class Backend(ABC):
    """A way to start and reach worker processes. One instance per process and option set.

    Subclasses set ``name``, ``capabilities`` and ``options``, and implement
    ``_start_group``. Optional features (``attach_group``) raise a clear
    ``NotImplementedError`` naming the backend unless overridden, and are
    declared in ``capabilities``.
    """

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities]
    options: ClassVar[Sequence[BackendOption]] = ()

    def __init__(self, **options: Any) -> None:
        self.config = self.validate_options(options)
        self._closed = False

    @classmethod
    def validate_options(cls, options: Mapping[str, Any]) -> dict[str, Any]:
        known = {o.name: o for o in cls.options}
        unknown = [k for k in options if k not in known]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, list(known), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            accepted = ", ".join(f"{o.name} ({o.help})" for o in cls.options) or "none"
            raise ValueError(
                f"backend {cls.name!r} does not accept option(s) {', '.join(hints)}. Accepted: {accepted}"
            )
        config = {o.name: o.default for o in cls.options}
        for key, value in options.items():
            opt = known[key]
            if value is not None and not isinstance(value, opt.type):
                raise TypeError(
                    f"backend option {key!r} of {cls.name!r} must be {opt.type}, got {type(value).__name__} "
                    f"({value!r})"
                )
            config[key] = value
        return config

    @classmethod
    def describe_environment(cls) -> list[str]:
        """Lines ``podium backends`` prints under this backend: what it can use on this host.

        Optional (default: nothing). Must be quick and must not raise for a
        missing tool; the torchrun backend lists torchx's schedulers here.
        """
        return []

    @classmethod
    def version(cls) -> str:
        """The version of the distribution that ships this backend."""
        from importlib.metadata import PackageNotFoundError, packages_distributions, version

        top = cls.__module__.split(".")[0]
        for dist in packages_distributions().get(top, []):
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
        return "unknown"

    # -- resources ---------------------------------------------------------

    def check_resources(self, pools: Sequence[ResourcePool]) -> None:  # noqa: B027 - optional hook
        """Raise :class:`podium.errors.ResourceUnavailableError` if the cluster can never hold ``pools``.

        Must answer fast (seconds) and start nothing. The default accepts everything.
        """

    # -- groups ------------------------------------------------------------

    def start_group(self, spec: GroupSpec) -> BackendGroup:
        """Start one rank per slot of ``spec.pool``; return when every rank's constructor ran.

        A failing user constructor raises the worker's exception (as a
        :class:`podium.RemoteError`); a process that cannot start raises
        :class:`podium.errors.WorkerStartupError`. Nothing is left running on failure.
        A pool that :meth:`check_resources` refuses raises its
        :class:`podium.errors.ResourceUnavailableError` before anything starts.
        """
        if self._closed:
            raise RuntimeError(f"backend {self.name!r} was shut down")
        bad = sorted(set(spec.worker_env) & set(RESERVED_ENV))
        if bad:
            raise ValueError(
                f"worker_env may not set {bad}: podium sets these per rank so that "
                "init_process_group() works. Remove them from worker_env."
            )
        for key, value in spec.worker_env.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"worker_env must map str to str, got {key!r}: {value!r}")
        from podium.core.serialization import ensure_importable_by_value
        from podium.core.worker import user_classes

        # Classes from test files or a script's sibling modules travel by value
        # (a worker started elsewhere could not import them), importable ones by
        # reference; one place for every backend.
        for cls in user_classes(spec.cls_with_init):
            ensure_importable_by_value(cls, self.worker_import_env(spec))
        # A pool the cluster can never hold is refused before anything starts.
        self.check_resources([spec.pool])
        return self._start_group(spec)

    def worker_import_env(self, spec: GroupSpec) -> Mapping[str, str]:
        """The environment that decides which user modules a worker can import by name.

        User classes whose module a worker can import go by reference (they stay
        themselves); the others by value (see :mod:`podium.core.importability`).
        By default a worker starts with this process's ``PYTHONPATH`` unless
        ``worker_env`` sets one. A backend whose workers start elsewhere (an
        existing cluster that does not inherit the controller's environment)
        overrides this so that modules reachable only through the controller's
        ``PYTHONPATH`` go by value.
        """
        return spec.worker_env

    @abstractmethod
    def _start_group(self, spec: GroupSpec) -> BackendGroup: ...

    def attach_group(self, name_prefix: str) -> BackendGroup:
        """Reach the running group named ``name_prefix`` (started by another controller)."""
        raise NotImplementedError(
            f"backend {self.name!r} has no named workers; WorkerGroup.attach() needs a backend "
            "with capabilities.named_workers (e.g. 'ray')"
        )

    def shutdown(self) -> None:
        """Release what the backend started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._shutdown()

    def _shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release backend-wide resources. Groups are shut down by their owners first."""


# -- discovery ---------------------------------------------------------------

_lock = threading.Lock()
_instances: dict[tuple[str, tuple[tuple[str, Any], ...]], Backend] = {}


def _entry_point_names() -> list[str]:
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


def load_plugins() -> tuple[dict[str, type[Backend]], dict[str, str]]:
    """Load every declared backend: (name -> class, name -> error text of those that failed)."""
    from stevedore import ExtensionManager

    failed: dict[str, str] = {}

    def on_failure(_manager: Any, entry_point: Any, exc: BaseException) -> None:
        failed[entry_point.name] = f"{type(exc).__name__}: {exc}"

    manager = ExtensionManager(
        namespace=ENTRY_POINT_GROUP,
        invoke_on_load=False,
        on_load_failure_callback=on_failure,
    )
    loaded = {ext.name: ext.plugin for ext in manager}
    return loaded, failed


def available_backends(*, include_failed: bool = False) -> dict[str, Any]:
    """Installed backends: name -> :class:`Capabilities`.

    With ``include_failed=True`` also returns the plugins that failed to load,
    as name -> error text, under the key ``"__failed__"``.
    """
    loaded, failed = load_plugins()
    result: dict[str, Any] = {name: plugin.capabilities for name, plugin in sorted(loaded.items())}
    if include_failed:
        result["__failed__"] = failed
    return result


def backend_class(name: str) -> type[Backend]:
    """Load only the entry point ``name`` and return its backend class."""
    from stevedore import DriverManager
    from stevedore.exception import NoMatches

    try:
        manager: Any = DriverManager(namespace=ENTRY_POINT_GROUP, name=name, invoke_on_load=False)
    except NoMatches:
        loaded, failed = load_plugins()
        close = difflib.get_close_matches(name, _entry_point_names() + list(KNOWN_EXTRAS), n=1)
        raise UnknownBackendError(
            name,
            sorted(loaded),
            failed=failed,
            suggestion=close[0] if close else None,
            extra=KNOWN_EXTRAS.get(name),
        ) from None
    except Exception as exc:  # the plugin is declared but its module failed to import
        installed, failed = load_plugins()
        failed.setdefault(name, f"{type(exc).__name__}: {exc}")
        missing_dependency = isinstance(exc, ImportError)
        raise UnknownBackendError(
            name,
            sorted(installed),
            failed=failed,
            extra=KNOWN_EXTRAS.get(name) if missing_dependency else None,
        ) from exc
    plugin = manager.driver
    if not (isinstance(plugin, type) and issubclass(plugin, Backend)):
        raise UnknownBackendError(
            name,
            _entry_point_names(),
            failed={name: f"entry point does not name a podium Backend subclass: {plugin!r}"},
        )
    return plugin


def _options_key(options: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    items = []
    for k, v in sorted(options.items()):
        try:
            hash(v)
        except TypeError:
            v = repr(v)
        items.append((k, v))
    return tuple(items)


def load_backend(name: str | None = None, **options: Any) -> Backend:
    """The backend ``name`` (default: ``$PODIUM_BACKEND``, else ``"ray"``) with ``options``.

    When ``name`` is the backend ``$PODIUM_BACKEND`` names, ``options`` start
    from ``$PODIUM_BACKEND_OPTIONS`` (see :func:`env_options`).

    One instance is shared per name and option set in a process, so groups
    started with the same settings share one cluster connection.
    """
    name = name or os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND
    from_env = env_options(name)
    if from_env:
        try:
            backend_class(name).validate_options(from_env)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"${OPTIONS_ENV}: {exc}") from None
        options = {**from_env, **options}
    key = (name, _options_key(options))
    with _lock:
        inst = _instances.get(key)
        if inst is not None and not inst._closed:
            return inst
    cls = backend_class(name)
    inst = cls(**options)
    with _lock:
        _instances[key] = inst
    return inst


def env_options(name: str) -> dict[str, Any]:
    """The options ``$PODIUM_BACKEND_OPTIONS`` gives backend ``name``.

    They belong to the backend ``$PODIUM_BACKEND`` names (else the default):
    loading that backend, by that name or by default, starts from them, and
    options passed in code override them one by one. Any other backend gets none.
    """
    raw = os.environ.get(OPTIONS_ENV, "").strip()
    if not raw or name != (os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND):
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"${OPTIONS_ENV} is not valid JSON ({exc}): {raw!r}. Give a JSON object, e.g. "
            f"""{OPTIONS_ENV}='{{"scheduler": "slurm", "scheduler_cfg": {{"partition": "debug"}}}}'"""
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"${OPTIONS_ENV} must be a JSON object of backend options, got {raw!r}")
    return value


def resolve_backend(backend: Backend | str | None, options: Mapping[str, Any] | None = None) -> Backend:
    if isinstance(backend, Backend):
        if options:
            raise ValueError("pass backend options when loading the backend, not with a Backend instance")
        return backend
    return load_backend(backend, **dict(options or {}))


def shutdown_backends() -> None:
    """Shut down every backend this process loaded (tests, interpreter exit)."""
    with _lock:
        instances = list(_instances.values())
        _instances.clear()
    for inst in instances:
        inst.shutdown()

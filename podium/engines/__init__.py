"""Training engines that run inside podium workers (import a submodule, e.g. ``podium.engines.fsdp``)."""

"""Power meters and energy per token (docs/energy.md): one interface over jtop, tegrastats, NVML and RAPL."""

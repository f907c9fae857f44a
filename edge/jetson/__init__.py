"""Make-driven deployment onto a Jetson AGX Orin (``deploy/jetson/jetson.mk``, ``smartexit jetson <action>``).

A layer beside ``edge.pipeline`` and ``scheduler`` (it reads their artifacts, never imports them):

- :mod:`edge.jetson.facts`: what a device is (L4T, JetPack, CUDA, TensorRT, cuDNN, Triton, Python, power
  mode, clocks, memory), parsed from the real strings those tools print;
- :mod:`edge.jetson.check`: ``jetson check``, the facts against the supported-versions table, a verdict;
- :mod:`edge.jetson.commands`: pure builders of every device command line (ssh, rsync, trtexec,
  systemctl, nvpmodel, ...), compared as lists by the tests;
- :mod:`edge.jetson.steps`: the dry run / real run of a list of commands through ``run_command``;
- :mod:`edge.jetson.push`: ``jetson push``, what the device needs with sha256 checked on arrival;
- :mod:`edge.jetson.record` and :mod:`edge.jetson.parity`: reference inputs / outputs recorded with
  ONNX Runtime at push time, and the comparison of each TensorRT engine against them on the device;
- :mod:`edge.jetson.engines`: ``jetson engines``, one TensorRT engine per graph with the device's trtexec;
- :mod:`edge.jetson.units` and :mod:`edge.jetson.serve`: systemd units for tritonserver and the Ray Serve
  app; ``jetson serve`` / ``status`` / ``stop``;
- :mod:`edge.jetson.bench`: ``jetson bench``, the decode and energy benchmarks run on the device and pulled
  back into ``artifacts/<run>/jetson/``.

Every action takes ``dry_run=true``: it prints the commands it would run, with the real paths, and
touches nothing. On-device actions (check, engines, serve, status, stop) on a machine without
``/etc/nv_tegra_release`` stop with exit code 2; in a dry run they print what they would run and say
that a real run would stop there (deploy/jetson/README.md).
"""

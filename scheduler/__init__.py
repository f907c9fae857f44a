"""Serving and its SLA scheduler, in three subpackages, each importing only those below it:

* ``scheduler.loadtest``: load tests and serving benchmarks (``smartexit bench serve / audit / scheduler /
  crosscheck``, ``smartexit profile``); nothing on a served request's path imports it;
* ``scheduler.serving``: everything that runs a served request: tritonserver's supervision, the Triton
  model, the bundle, the Triton client, the Ray Serve app, metrics and the dashboard (``smartexit serve``);
* ``scheduler.control``: the control policies, the simulator, recurrent-PPO training, the exit-depth
  predictor, workloads and request outcomes.
"""

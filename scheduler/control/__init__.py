"""The SLA scheduler: control policies (fixed, AIMD, max-delay, learned), the serving simulator, recurrent-PPO
training and the exit-depth predictor. Below ``scheduler.serving`` (whose worker runs a policy each control
tick) and ``scheduler.loadtest``."""

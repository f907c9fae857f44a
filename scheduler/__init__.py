"""Workloads, the serving simulator, the recurrent-PPO SLA scheduler and the Ray Serve app."""

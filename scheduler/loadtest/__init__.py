"""Load tests and serving benchmarks: schedules and drivers, senders, the serve / audit / scheduler
benchmarks, the step-time profile and the serving-path fit. Above ``scheduler.serving`` and
``scheduler.control``; nothing on a served request's path imports it."""

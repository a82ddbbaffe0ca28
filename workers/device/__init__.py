"""The device a worker runs on: its dtype, host-to-device copies, idle time, CPU features."""

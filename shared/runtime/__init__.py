"""What every service process runs on: its entry point and loops (`service_main.py`), settings
fields several services share, /metrics, logs, experiment tracking, the health probe, torch's
threads and torch.distributed plumbing."""

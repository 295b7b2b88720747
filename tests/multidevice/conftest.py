# Eight virtual CPU devices, set before JAX is imported. This folder runs in its
# own pytest process (see tests/test_many_devices.py), never in the main one.
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

"""The Jetson source: GPU load, clocks, power rails and thermal zones, read from sysfs."""

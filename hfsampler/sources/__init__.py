"""Sources of samples: the ``Source`` protocol (``base``); NVML, Jetson, the simulator, DCGM."""

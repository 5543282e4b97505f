"""Sampling: the run plan, the sampler process and its lanes, the rings and the windows."""

"""The simulated source: seeded synthetic GPUs with spikes, leaks and throttling episodes."""

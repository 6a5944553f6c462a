"""The data plane: the agent contract, the built-in shm agent, bounce buffers, fragments, bench baselines."""

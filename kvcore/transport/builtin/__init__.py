"""What the core registers through its own hooks, exactly as an external plugin would."""

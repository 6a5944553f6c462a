"""The command-line tools (CLI, demo, bench): built on the library, never imported by it."""

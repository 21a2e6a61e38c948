"""Code a Python process may run at start-up (from a .pth file): nothing heavy is imported here."""

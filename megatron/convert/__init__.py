"""Weight and config mappings between this framework's models and other libraries' (HuggingFace)."""

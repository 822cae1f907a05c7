"""Code documents at repository level: dependency order and rendering (StarCoder2 / DeepSeek-Coder style)."""

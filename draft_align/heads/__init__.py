"""Draft heads: EAGLE-3 (and its vocabulary map)."""

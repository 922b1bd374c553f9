"""Wire formats: engine results to API bodies and stream lines (pure, no Twisted)."""

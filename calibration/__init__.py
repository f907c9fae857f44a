"""Exit signals, Platt / isotonic calibrators and risk-controlled threshold tables (issue 3)."""

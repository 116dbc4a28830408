"""Stage 2, selection: choose one layout per tensor and one implementation per operator (an ILP)."""

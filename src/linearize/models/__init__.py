"""HF integration: teachers, architecture adapters, the linearized attention, state cache, convert."""

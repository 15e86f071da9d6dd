"""Pure tensor ops, each in three forms with one meaning (see ``ops.common`` for the conventions)."""

"""Re-run state machine: validate results, re-run a step, attribute NaN and spiky loss."""

"""One run's training: the components, the loop, the step record, the check, resume and micro_batch=auto."""

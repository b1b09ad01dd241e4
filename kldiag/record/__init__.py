"""Recording: the Recorder on the training thread, its writer threads, and host batches to Arrow rows."""

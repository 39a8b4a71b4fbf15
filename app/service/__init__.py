"""The HTTP service around the engine: the server and its lifespan, the scheduler (the worker thread that
admits requests and steps the engine), the runtime the routes read, metrics, settings and logs."""

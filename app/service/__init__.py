"""The service around the engine: the scheduler (the worker thread that admits requests and steps the engine),
the runtime the routes read, metrics, settings and logs. It imports nothing of app/api: the app that serves it is
app.api.server."""

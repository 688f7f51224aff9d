"""The versioned REST API of the controller (routers mounted by ``service.api.app.create_app``)."""

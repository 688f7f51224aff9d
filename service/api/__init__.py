"""The versioned REST API of the controller (routers mounted by ``service.main.create_app``)."""

"""Running a fleet of versions: the model catalog, weighted aliases, live reload and drain, the
requests in flight per version, the admin socket and ``ferry reload | status | drain | weights``."""

"""What the three services share: settings, app factory, errors, middleware, clients."""

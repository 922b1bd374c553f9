"""The serving core both modes stand on: start-up, the loopback site, writers, routes, checks."""

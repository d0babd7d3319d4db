"""Clients of npud: the client library (clients.client) and the tools built on it."""

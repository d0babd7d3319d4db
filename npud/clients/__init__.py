"""Clients of npud: the client library (npud.clients.client) and the tools built on it."""

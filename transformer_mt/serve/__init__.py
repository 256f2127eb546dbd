"""Translations over HTTP: requests batched together on one worker and the web app that takes them."""

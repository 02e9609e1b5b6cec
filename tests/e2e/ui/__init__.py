"""The UI smoke test: `rankflow ui` in headless Chromium."""

"""Grafana dashboards for tandem, built as code (`build.py`) and exported to JSON here."""

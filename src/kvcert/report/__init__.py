"""Reports: results.json (every number with its tier), PNG figures, self-contained HTML, rich tables."""

__all__ = ["aggregate", "figures", "html", "results", "tables"]

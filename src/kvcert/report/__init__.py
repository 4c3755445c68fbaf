"""Reports: results.json (every number with its tier), PNG figures, self-contained HTML, rich tables."""

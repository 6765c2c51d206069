"""HTML reports (see the reports issue); a plain-text summary until then."""

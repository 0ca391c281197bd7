"""The run directory: results (summary.json, metrics.csv), status (writer, reader and
`fedpilot-scheduler status`), and plots/TensorBoard."""

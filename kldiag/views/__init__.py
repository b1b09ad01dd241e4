"""Views: what the dashboard and the report show, shaped from an analysis and a diagnosis (pandas, no Streamlit)."""

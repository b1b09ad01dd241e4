"""kldiag dashboard. Start it with `kldiag dashboard RUN_DIR [RUN_DIR ...]`
(or `streamlit run app/main.py -- RUN_DIR ...`, or KLDIAG_RUNS=RUN_DIR streamlit run app/main.py)."""

import dash_controls
import dash_data
import streamlit as st

st.set_page_config(page_title="kldiag", page_icon=":material/monitoring:", layout="wide")

PAGES = [
    st.Page("app_pages/overview.py", title="Overview", icon=":material/dashboard:", url_path="overview", default=True),
    st.Page("app_pages/distributions.py", title="Distributions", icon=":material/stacked_bar_chart:",
            url_path="distributions"),
    st.Page("app_pages/tokens.py", title="Tokens", icon=":material/flag:", url_path="tokens"),
    st.Page("app_pages/sequence.py", title="Sequence", icon=":material/notes:", url_path="sequence"),
    st.Page("app_pages/estimators.py", title="Estimators", icon=":material/functions:", url_path="estimators"),
    st.Page("app_pages/compare.py", title="Compare", icon=":material/compare_arrows:", url_path="compare"),
    st.Page("app_pages/mismatch.py", title="Mismatch", icon=":material/difference:", url_path="mismatch"),
]

page = st.navigation(PAGES)
dash_controls.restore(dash_data.labels(dash_data.run_paths()))  # a deep link: run, step, sequence, token
dash_data.sidebar()
page.run()

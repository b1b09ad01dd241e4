"""The package list, beside pyproject.toml (which holds everything else): kldiag's own packages, and the two
folders of the source tree that the wheel ships inside the package, where an installed kldiag finds them
(kldiag/cli/resources.py):

    app/           -> kldiag/_app       the Streamlit dashboard (`kldiag dashboard`)
    docs/grafana/  -> kldiag/_grafana   the Grafana dashboard and alert rules (`kldiag grafana`)

pyproject.toml alone cannot map a folder outside the package into it while finding the packages."""

from setuptools import find_packages, setup

SHIPPED = {"kldiag._app": "app", "kldiag._app.app_pages": "app/app_pages", "kldiag._grafana": "docs/grafana"}

setup(
    packages=[*find_packages(include=["kldiag", "kldiag.*"]), *SHIPPED],
    package_dir=SHIPPED,
    package_data={"kldiag._app": ["favicon.png"], "kldiag._grafana": ["*.json", "*.yml"]},
)

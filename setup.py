"""Packaging from settings.ini (nbdev 2 layout): one source of truth for name, version and requirements."""
from configparser import ConfigParser

import setuptools

cfg = ConfigParser(delimiters=["="])
cfg.read("settings.ini")
c = cfg["DEFAULT"]

requirements = c.get("requirements", "").split()
dev_requirements = c.get("dev_requirements", "").split()
console_scripts = [s.strip() for s in c.get("console_scripts", "").split() if s.strip()]

setuptools.setup(
    name=c["lib_name"],
    version=c["version"],
    description=c["description"],
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    author=c["author"],
    author_email=c["author_email"],
    license="Apache-2.0",
    url=c["git_url"],
    packages=setuptools.find_packages(include=["powerclip", "powerclip.*"]),
    include_package_data=True,
    package_data={"powerclip": ["model_configs/*.json", "presets/*.yaml"]},
    python_requires=">=" + c["min_python"],
    install_requires=requirements,
    extras_require={"dev": dev_requirements},
    entry_points={"console_scripts": console_scripts, "nbdev": [f"{c['lib_path']}={c['lib_path']}._modidx:d"]},
    zip_safe=False,
)

"""DatabaseSettings: read once from the environment, validated."""

from __future__ import annotations

import pytest

from tenants import DEFAULT_DATABASE_URL, DatabaseSettings, InvalidFieldError


def test_default_is_a_sqlite_file_in_the_working_directory() -> None:
    settings = DatabaseSettings.from_env({})
    assert settings.url == DEFAULT_DATABASE_URL == "sqlite:///./tiergate.db"
    assert settings.is_sqlite


def test_url_from_environment() -> None:
    url = "postgresql+psycopg://tiergate@db:5432/tiergate"
    settings = DatabaseSettings.from_env({"TIERGATE_DATABASE_URL": url})
    assert settings.url == url
    assert not settings.is_sqlite


def test_empty_variable_means_default() -> None:
    assert DatabaseSettings.from_env({"TIERGATE_DATABASE_URL": ""}).url == DEFAULT_DATABASE_URL


def test_rejects_what_is_not_a_url() -> None:
    with pytest.raises(InvalidFieldError) as caught:
        DatabaseSettings(url="not a url")
    assert caught.value.param == "database_url"


def test_rejects_an_empty_pool() -> None:
    with pytest.raises(InvalidFieldError):
        DatabaseSettings(pool_size=0)

"""Output that follows a JSON Schema: templates whose slots only hold valid values, for the
diffusion engine. The AR engine's token masks are `nowait.engines.structured.grammar`, imported
by its own path because it loads llguidance, which only engines that constrain output need.
Import-only: each name lives in its module."""

from nowait.engines.structured.templates import (
    ConstrainedTemplate,
    SchemaTemplateError,
    Template,
    TemplateCompiler,
    build_template,
    compile_template,
    fill_template,
    read_template,
)

__all__ = [
    "ConstrainedTemplate",
    "SchemaTemplateError",
    "Template",
    "TemplateCompiler",
    "build_template",
    "compile_template",
    "fill_template",
    "read_template",
]

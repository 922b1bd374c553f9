"""llama.cpp's automatic chat parser: a chat template's reasoning, content and tool-call markers
found by differential rendering (:mod:`.analysis`)."""

from bankml.engine_cupy.autoparser.analysis import (
    AnalysisError,
    CallIdPosition,
    ContentAnalysis,
    ContentMode,
    ReasoningAnalysis,
    ReasoningMode,
    TemplateAnalysis,
    ToolArgumentsAnalysis,
    ToolFormat,
    ToolFormatAnalysis,
    ToolFunctionAnalysis,
    ToolIdAnalysis,
    ToolsAnalysis,
    analyze_template,
)

__all__ = [
    "AnalysisError",
    "CallIdPosition",
    "ContentAnalysis",
    "ContentMode",
    "ReasoningAnalysis",
    "ReasoningMode",
    "TemplateAnalysis",
    "ToolArgumentsAnalysis",
    "ToolFormat",
    "ToolFormatAnalysis",
    "ToolFunctionAnalysis",
    "ToolIdAnalysis",
    "ToolsAnalysis",
    "analyze_template",
]

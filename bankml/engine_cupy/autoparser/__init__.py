"""llama.cpp's automatic chat parser: a chat template's reasoning, content and tool-call markers
found by differential rendering (:mod:`.analysis`, exported here), the prompt, PEG parser and
grammar of a chat request built from them (:mod:`.generator`), llama.cpp's specialised handlers
for the templates it does not analyse (:mod:`.dedicated`), and the request flow that chooses
between them (:mod:`.apply`). The last three are imported by their module paths: chat_template imports this package for the analysis, and they import
chat_template."""

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

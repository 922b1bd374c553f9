"""llama-server's PEG parser and its chat layer: how a model's chat output is read into content,
reasoning and tool calls, and how the grammar that constrains tool calls is written.

    peg.parser   the arena of parsers, its builder and the parse (common/peg-parser.cpp)
    peg.gbnf     the GBNF grammar of an arena (common_peg_arena::build_grammar)
    peg.schema   what the grammar writer asks of a JSON schema
    peg.chat     the chat builder, the AST-to-message mappers, chat_peg_parse
"""

// llama.cpp's own schema-to-grammar conversion as a test oracle.
//
// Usage: json-schema-grammar MODEL.gguf < requests > answers, one JSON object a line each way.
//   {"mode": "completion", "schema": S}              json_schema_to_grammar(S), as /completion does
//   {"mode": "chat", "schema": S, "messages": [...]}  common_chat_templates_apply with json_schema S
//                                                     and the model's chat template, as chat does
//   {"mode": "mask", "grammar": G, "tokens": [...]}   llama.cpp's grammar sampler on G: before each
//                                                     token and after the last, the allowed tokens
// Answer: {"grammar": ..., "lazy": ..., "generation_prompt": ...}, {"masks": ["0110…", …]}
// (one character per vocabulary entry) or {"error": what()}.
#include "chat.h"
#include "json-schema-to-grammar.h"
#include "json.h"
#include "llama.h"

#include <cmath>
#include <iostream>
#include <vector>
#include <string>

using json = common_json;

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::cerr << "usage: json-schema-grammar MODEL.gguf\n";
        return 2;
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    auto mparams       = llama_model_default_params();
    mparams.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (!model) {
        std::cerr << "cannot load " << argv[1] << "\n";
        return 1;
    }
    auto tmpls = common_chat_templates_init(model, "");
    std::string line;
    while (std::getline(std::cin, line)) {
        json req = json::parse(line);
        json out = json::object();
        try {
            const std::string mode = req.at("mode").get<std::string>();
            if (mode == "mask") {
                const llama_vocab * vocab = llama_model_get_vocab(model);
                const int n_vocab = llama_vocab_n_tokens(vocab);
                const std::string grammar = req.at("grammar").get<std::string>();
                llama_sampler * grmr = llama_sampler_init_grammar(vocab, grammar.c_str(), "root");
                if (!grmr) {
                    throw std::runtime_error("failed to parse grammar");
                }
                json masks = json::array();
                std::vector<llama_token> tokens;
                const json & ids = req.at("tokens");
                for (size_t i = 0; i < ids.size(); i++) {
                    tokens.push_back(ids.at(i).get<int>());
                }
                std::vector<llama_token_data> cand(n_vocab);
                for (size_t step = 0; step <= tokens.size(); step++) {
                    for (int i = 0; i < n_vocab; i++) {
                        cand[i] = { i, 0.0f, 0.0f };
                    }
                    llama_token_data_array arr = { cand.data(), cand.size(), -1, false };
                    llama_sampler_apply(grmr, &arr);
                    std::string bits(n_vocab, '0');
                    for (size_t i = 0; i < arr.size; i++) {
                        if (arr.data[i].logit != -INFINITY) {
                            bits[arr.data[i].id] = '1';
                        }
                    }
                    masks.push_back(bits);
                    if (step < tokens.size()) {
                        llama_sampler_accept(grmr, tokens[step]);
                    }
                }
                llama_sampler_free(grmr);
                out["masks"] = masks;
            } else if (mode == "completion") {
                out["grammar"] = json_schema_to_grammar(req.at("schema"));
            } else {
                common_chat_templates_inputs inputs;
                inputs.messages    = common_chat_msgs_parse_oaicompat(req.at("messages"));
                inputs.json_schema = req.at("schema").dump();
                auto params              = common_chat_templates_apply(tmpls.get(), inputs);
                out["grammar"]           = params.grammar;
                out["lazy"]              = params.grammar_lazy;
                out["generation_prompt"] = params.generation_prompt;
            }
        } catch (const std::exception & e) {
            out["error"] = std::string(e.what());
        }
        std::cout << out.dump() << std::endl;
    }
    llama_model_free(model);
    return 0;
}

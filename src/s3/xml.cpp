#include "s3/xml.hpp"

#include <expat.h>

#include <memory>

namespace ferry::s3 {
namespace {

constexpr size_t kMaxDepth = 16;
constexpr size_t kMaxElements = 1u << 20;

struct Builder {
  XmlNode root;
  std::vector<XmlNode*> stack;
  size_t elements = 0;
  std::string error;
  XML_Parser parser = nullptr;

  void fail(std::string why) {
    if (error.empty()) error = std::move(why);
    XML_StopParser(parser, XML_FALSE);
  }
};

std::string local_name(const XML_Char* name) {
  std::string n(name);
  auto colon = n.rfind(':');
  return colon == std::string::npos ? n : n.substr(colon + 1);
}

void XMLCALL on_start(void* data, const XML_Char* name, const XML_Char** /*attrs*/) {
  auto* b = static_cast<Builder*>(data);
  if (b->stack.size() >= kMaxDepth) return b->fail("nested deeper than 16 elements");
  if (++b->elements > kMaxElements) return b->fail("more than 2^20 elements");
  if (b->stack.empty()) {
    b->root.name = local_name(name);
    b->stack.push_back(&b->root);
    return;
  }
  XmlNode* parent = b->stack.back();
  parent->children.push_back(XmlNode{local_name(name), {}, {}});
  b->stack.push_back(&parent->children.back());
}

void XMLCALL on_end(void* data, const XML_Char* /*name*/) {
  auto* b = static_cast<Builder*>(data);
  if (!b->stack.empty()) b->stack.pop_back();
}

void XMLCALL on_text(void* data, const XML_Char* s, int len) {
  auto* b = static_cast<Builder*>(data);
  if (!b->stack.empty()) b->stack.back()->text.append(s, static_cast<size_t>(len));
}

}  // namespace

const XmlNode* XmlNode::child(const std::string& n) const {
  for (const auto& c : children)
    if (c.name == n) return &c;
  return nullptr;
}

std::string XmlNode::child_text(const std::string& n) const {
  const XmlNode* c = child(n);
  return c ? c->text : std::string();
}

Result<XmlNode> parse_xml(const std::string& doc, const std::string& what) {
  // The stack keeps pointers into the tree: only the innermost open element
  // gains children, so no vector holding an open element ever grows.
  std::unique_ptr<std::remove_pointer_t<XML_Parser>, decltype(&XML_ParserFree)> parser(
      XML_ParserCreate(nullptr), &XML_ParserFree);
  if (!parser) return Status::internal("cannot create an XML parser for " + what);
  Builder b;
  b.parser = parser.get();
  XML_SetUserData(parser.get(), &b);
  XML_SetElementHandler(parser.get(), on_start, on_end);
  XML_SetCharacterDataHandler(parser.get(), on_text);
  if (doc.size() > (1u << 30)) return Status::corruption(what + ": document over 1 GiB");
  if (XML_Parse(parser.get(), doc.data(), static_cast<int>(doc.size()), XML_TRUE) !=
          XML_STATUS_OK ||
      !b.error.empty()) {
    std::string why = !b.error.empty() ? b.error : XML_ErrorString(XML_GetErrorCode(parser.get()));
    return Status::corruption(what + ": malformed XML (" + why + ") at line " +
                              std::to_string(XML_GetCurrentLineNumber(parser.get())));
  }
  if (b.root.name.empty()) return Status::corruption(what + ": empty XML document");
  return std::move(b.root);
}

std::string xml_escape(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace ferry::s3
